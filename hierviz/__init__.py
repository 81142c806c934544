"""hierviz: hierarchical speculative decoding (EAGLE-2 tree -> intermediate -> 4-bit target), visualized."""
__version__ = "0.1.0"
