"""What a run reports while it trains: metrics, samples, the held-out validation loss, start-up marks."""
