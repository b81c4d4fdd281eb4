"""jaxcomm."""
