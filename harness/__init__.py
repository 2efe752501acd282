"""The one harness shared by tests/, bench/ and loadtest/: processes of this project started and
stopped with bounded waits (processes.py), tiny random models for mechanics (models.py), data
(data.py), and measurement - exact percentiles, recall, CPU accounting (measure.py).

Nothing here is imported by the server itself.
"""
