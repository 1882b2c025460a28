"""Run: the Doctor (attaches to a whole process), discovery, observers, child processes, repairs, the launcher."""
