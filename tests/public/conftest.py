# The *_style.py files are training scripts that the tests run as subprocesses; pytest must not import them
# (the suite runs with --doctest-modules).
collect_ignore_glob = ["*_style.py"]
