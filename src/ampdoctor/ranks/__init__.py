"""Several processes: rank facts, the hand-over of reports to rank 0, their merge, AMP411, and who says what."""
