from django.urls import path

from memories.portal import views

urlpatterns = [
    path("", views.home, name="portal-home"),
    path("open/<str:token>", views.link_open, name="portal-open"),
    path("forget", views.forget, name="portal-forget"),
    path("requests/<str:request_id>", views.request_detail, name="portal-request"),
    path("sign-out", views.sign_out, name="portal-sign-out"),
]
