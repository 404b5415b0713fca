"""What happened in a run: comparisons, plots and the HTML report."""
