"""Show: the command line, console rendering, report files and the demo."""
