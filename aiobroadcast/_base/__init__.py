"""The shared base of every role family: errors, tuning, codecs, handles, step drivers,
fork handling and statistics. Imports nothing else of the package."""
