"""Other backends for the decoder graph (the host side stays gemmalite's)."""
