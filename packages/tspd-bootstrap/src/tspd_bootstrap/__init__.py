"""tspd bootstrap server: the HTTP rendezvous through which decode ranks find prefill ranks."""

__version__ = "0.1.0"
