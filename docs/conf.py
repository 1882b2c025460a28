"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build`` (needs ``pip install "ampdoctor[docs]"``)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE / "_ext")]  # document this checkout's ampdoctor

from ampdoctor import __version__  # noqa: E402

project = "ampdoctor"
release = version = __version__
extensions = ["myst_parser", "generated_pages"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "rules/examples"]
html_theme = "furo"
html_title = f"ampdoctor {__version__}"
html_show_copyright = False  # no owner to name yet
smartquotes = False  # a page shows ampdoctor's own text: ' and -- stay as `ampdoctor explain` prints them
myst_heading_anchors = 3
