"""Explain: crash explanations from the rule catalog."""
