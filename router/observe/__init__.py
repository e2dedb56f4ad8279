"""What the router learns of each replica off the request path: metrics scrapes (scraper, vllm_metrics,
metric_batch), health probes (probes) and outlier ejection (outlier)."""
