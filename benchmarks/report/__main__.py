"""`python -m benchmarks.report`: re-render BENCHMARKS.md and its plots, and README.md's figures, from the committed
results files."""

from benchmarks.report.page import main
from benchmarks.report.readme import refresh_readme

main()
if refresh_readme():
    print("README.md")
