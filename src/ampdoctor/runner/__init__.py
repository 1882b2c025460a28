"""Run: the Doctor (attaches to a whole process), the script launcher and the demo."""
