"""Where the time went: per-rank timelines, idle causes, traces and pictures."""
