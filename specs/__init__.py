"""The shipped specs, installed as package data (`importlib.resources.files("ncd.specs")`)."""
