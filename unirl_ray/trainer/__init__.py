"""Domain trainers: thin single controllers that own the stage order."""
