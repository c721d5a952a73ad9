"""Reports for people and machines: ``report.json``, ``report.md``, a self-contained
``report.html`` and the PNG plots."""
