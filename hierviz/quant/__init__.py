"""Weight formats and their kernels. Importing the package registers the built-in formats in
hierviz.quant.formats.FORMATS, in this order (each module registers itself; formats.py imports
none of them): a further format adds its import here."""
from hierviz.quant import w4  # noqa: F401
from hierviz.quant import w8a8  # noqa: F401
from hierviz.quant import fp8  # noqa: F401
