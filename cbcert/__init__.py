"""cbcert: certify and stress-test image classifiers under perturbations made through a generator."""

__version__ = "0.1.0"
