"""What is decided once, at wrap time: which params go in which bucket, the
plan and its report, the cross-rank check that every rank planned alike."""
