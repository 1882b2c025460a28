"""A launcher that starts the real training in a child Python process, as many repos' run.py scripts do."""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
result = subprocess.run([sys.executable, os.path.join(here, "seed.py")])
print(f"child exited with {result.returncode}")
