"""Show: the command line, console rendering and report files."""
