"""Run: ``ampdoctor run``'s process side: the Doctor (discovery), the script launcher and child processes."""
