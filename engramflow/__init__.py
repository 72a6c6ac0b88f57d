"""engramflow: Ray-native inference with Engram conditional memory."""
__version__ = "0.1.0"
