"""What consumes recorded outcomes: calendar write-back, e-mail and webhook notices, the status model."""
