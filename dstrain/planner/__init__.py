"""Predicting a layout before running it: closed-form costs that need no torch, so they run on a
laptop."""
