"""One booking's container: its spec and start, booking.json, its SSH and JupyterLab, its provenance."""
