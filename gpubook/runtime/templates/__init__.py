"""Container templates and their images: template files, registry pulls, the sshd/sudo overlay image."""
