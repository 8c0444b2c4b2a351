"""Distribution: moving what the factory built to where it is served (wheelhouse for offline installs)."""
