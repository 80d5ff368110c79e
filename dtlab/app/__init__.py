"""What a user drives: the command line, the notebook panel and the benchmark suite."""
