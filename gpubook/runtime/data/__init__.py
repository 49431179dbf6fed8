"""A booker's data on the host: the data folders, their measured usage, the SFTP data service."""
