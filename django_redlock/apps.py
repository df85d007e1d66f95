from django.apps import AppConfig


class RedlockConfig(AppConfig):
    name = "django_redlock"
    verbose_name = "Redis locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks

        from . import conf  # noqa: F401  (connects the setting_changed receiver)
        from .checks import check_node_settings, check_settings

        checks.register(check_settings, "redlock")
        checks.register(check_node_settings, "redlock", deploy=True)
