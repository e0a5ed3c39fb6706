"""The study v2 package (issue 38): a spec (spec.py), every run and the choice rule (plan.py), running them
(runner.py, records.py), whether val and test are held out (held_out.py), core-hours (hours.py), paired statistics
(stats.py), tables and the summary (report.py).
`python -m benchmarks.study --help`; README.md here documents the spec and the summary's schema."""
