"""Core data: findings, the rule catalog, the training setup under examination, reports, environment."""
