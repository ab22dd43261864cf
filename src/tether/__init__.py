"""tether: safe, fast and auditable hands for language-model agents on real machines."""

__version__ = "0.1.0"
