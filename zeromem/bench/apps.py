from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "zeromem.bench"
    label = "zeromem_bench"
    verbose_name = "Benchmarks and evaluations"
