"""One-off experiments and models behind podcute's design choices (README.md in this folder
says which question each answered and which docs/notes file holds the finding). The
benchmarks themselves are one level up, in ``perf``."""
