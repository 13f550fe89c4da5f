"""What the run reports about quality while it trains: validation loss and sample clips."""
