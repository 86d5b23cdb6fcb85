"""The gateway side: one Ray Serve deployment, the HTTP door in front of every model."""
