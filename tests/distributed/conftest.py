# The scripts under these folders start process groups or train at import: run them as programs, never import them
# (pytest runs with --doctest-modules).
collect_ignore_glob = ["rule_scripts/*", "scripts/*", "stats_scripts/*"]
