"""The demo's inventory app: products whose stock is decremented under a Redis lock."""
