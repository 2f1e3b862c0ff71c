"""The db layer: the profile DB (store) and the shape model fitted over its points."""
