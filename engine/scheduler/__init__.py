"""Requests and the continuous-batching scheduler."""
