"""Documents and tables with no I/O: what every tenant agrees on, readable and testable on its own."""
