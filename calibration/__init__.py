"""Text sources for calibration and evaluation."""
