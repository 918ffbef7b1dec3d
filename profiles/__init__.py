"""Device profiles shipped with rafl (YAML). Installed as package data `rafl.profiles`."""
