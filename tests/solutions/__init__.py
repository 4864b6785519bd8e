"""Exercise solutions written apart from the reference, to show the judges accept other correct code."""
