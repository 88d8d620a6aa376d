"""What the job tells its user: summary, progress line, live metrics, throughput."""
