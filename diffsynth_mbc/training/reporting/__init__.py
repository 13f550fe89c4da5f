"""What a rank tells the world: status and history files, progress, the terminal, ETA and honest step times."""
