"""dpgs: distributed parallel gradient stacking for multiple-instance learning on whole-slide images."""

__version__ = "0.1.0"
