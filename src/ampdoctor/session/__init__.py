"""Run: the one lifecycle of a run (pre-flight, fix, guard, watch, explanation, the end) and what it observes."""
