"""cbcert: certify and stress-test classifiers under perturbations made through a generator."""

__version__ = "0.1.0"
