"""Reliability suite: a live `tinyoss serve tiny` subprocess, attacked with bad input, slow and
vanishing clients, floods and limits. See conftest.py for the server and helpers.py for the
counters every response goes through."""
